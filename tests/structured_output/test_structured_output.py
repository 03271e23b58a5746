"""Structured outputs below the server: validation, compilation against the tiny vocabulary, the
matchers driven by random walks through the allowed tokens, and the device bitmask."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from vllm.structured_output import StructuredOutputsParams as S
from vllm.structured_output.bitmask import apply_token_bitmask, apply_token_bitmask_ref

xgr = pytest.importorskip("xgrammar")
EOS = [0, 4, 6]


@pytest.mark.parametrize("b,v", [(1, 1), (3, 31), (4, 32), (5, 100), (2, 1024)])
def test_bitmask_matches_definition(b, v):
    g = torch.Generator().manual_seed(b * 1000 + v)
    logits = torch.randn(b, v, generator=g)
    words = torch.randint(-(2**31), 2**31 - 1, (b, (v + 31) // 32), generator=g, dtype=torch.int64)
    bm = words.to(torch.int32)
    bm[0] = -1  # a row that allows everything
    want = apply_token_bitmask_ref(logits, bm)
    got = apply_token_bitmask(logits.clone(), bm)
    assert torch.equal(got, want)
    assert torch.isfinite(got[0]).all()


@pytest.mark.parametrize(
    "params,match",
    [
        (S(), "set exactly one"),
        (S(json={"type": "object"}, regex="a"), "got json, regex"),
        (S(json="[1,"), "structured_outputs.json"),
        (S(json=[1, 2]), "structured_outputs.json"),
        (S(json={"type": "strin"}), 'Unsupported type "strin"'),
        (S(regex="a(b"), "structured_outputs.regex: .*parenthesis"),
        (S(choice=[]), "non-empty list"),
        (S(choice=["a", ""]), "non-empty"),
        (S(grammar="root ::= "), "structured_outputs.grammar"),
        (S(structural_tag="{}"), "structured_outputs.structural_tag"),
    ],
)
def test_bad_constraints_refused(params, match):
    with pytest.raises(ValueError, match=match):
        params.validate()
    assert "/project/" not in _msg(params)  # no library source locations in user messages


def _msg(p):
    try:
        p.validate()
    except ValueError as e:
        return str(e)
    return ""


@pytest.fixture(scope="module")
def tok_and_manager(tiny_ckpt):
    from vllm.structured_output.manager import StructuredOutputManager
    from vllm.tokenizer import Tokenizer

    return Tokenizer(tiny_ckpt), StructuredOutputManager(tiny_ckpt, 1024, EOS)


def _walk(m, rid, seed, limit=400):
    """Sample uniformly among the allowed tokens until EOS; returns the ids before EOS."""
    deadline = time.monotonic() + 60
    while (r := m.ready(rid)) is False:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert r is True, r
    rng, out = random.Random(seed), []
    for _ in range(limit):
        row = m.bitmask([rid])[0]
        allowed = [t for t in range(1024) if (int(row[t // 32]) >> (t % 32)) & 1]
        t = rng.choice(allowed)
        assert m.accept(rid, t)
        if t in EOS:
            assert m.terminated(rid)
            return out
        out.append(t)
    raise AssertionError("no EOS within the limit")


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Zürich", "Tōkyō"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 30},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["city", "days", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", range(20))
def test_random_walks_satisfy_the_constraint(tok_and_manager, seed):
    jsonschema = pytest.importorskip("jsonschema")
    tok, m = tok_and_manager
    cases = {
        "schema": S(json=SCHEMA),
        "choice": S(choice=["yes", "no", 'say "hi" ünï']),
        "regex": S(regex=r"[0-9]{3}-[a-z]{2}"),
        "ebnf": S(grammar='root ::= "(" [0-9]+ ")"'),
    }
    for name, p in cases.items():
        rid = f"{name}-{seed}"
        m.add(rid, p)
        text = tok.decode(_walk(m, rid, seed))
        m.remove(rid)
        if name == "schema":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif name == "choice":
            assert text in p.choice
        elif name == "regex":
            assert len(text) == 6 and text[:3].isdigit() and text[3] == "-", text
        else:
            assert text.startswith("(") and text.endswith(")") and text[1:-1].isdigit(), text


def test_compile_is_cached_and_off_thread(tok_and_manager):
    _, m = tok_and_manager
    m.add("x1", S(json=SCHEMA))
    m.add("x2", S(json=json.dumps(SCHEMA)))  # the same schema as text: different cache key
    m.add("x3", S(json=SCHEMA))
    assert m._pending["x1"] is m._pending["x3"]
    for rid in ("x1", "x2", "x3"):
        _walk(m, rid, 0)
        m.remove(rid)
    assert not m._matchers and not m._pending
