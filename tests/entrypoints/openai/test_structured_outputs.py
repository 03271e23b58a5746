"""Structured outputs through the server with the real `openai` client, on the random-weight
tiny model: whatever the weights, the text follows the constraint."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.utils import RemoteServer

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "tiny-glm-5.3"
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


@pytest.fixture(scope="module")
def client(tiny_ckpt):
    with RemoteServer([tiny_ckpt, "--served-model-name", MODEL]) as s:
        yield openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)


def test_json_schema_over_20_seeds(client):
    for seed in range(20):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Plan a trip."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "trip", "schema": SCHEMA},
            },
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        c = r.choices[0]
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_json_object_streaming(client):
    """Any JSON object; a random model may stay inside a string until max_tokens, so a run that
    stops must parse as an object, and one cut by length must at least be a started object."""
    stopped = 0
    for seed in range(6):
        chunks = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "JSON please"}],
            response_format={"type": "json_object"},
            temperature=0.7,
            seed=seed,
            max_tokens=300,
            stream=True,
        )
        text, finish = "", None
        for c in chunks:
            if c.choices:
                text += c.choices[0].delta.content or ""
                finish = c.choices[0].finish_reason or finish
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
            stopped += 1
        else:
            assert finish == "length" and text.startswith("{"), (finish, text)
    assert stopped > 0


def test_upstream_structured_outputs_field(client):
    for seed in range(5):
        r = client.completions.create(
            model=MODEL,
            prompt="Answer:",
            max_tokens=20,
            temperature=1.0,
            seed=seed,
            extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}},
        )
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", r.choices[0].text), r.choices[0].text
        r = client.completions.create(
            model=MODEL,
            prompt="Yes or no?",
            max_tokens=20,
            temperature=1.0,
            seed=seed,
            extra_body={"structured_outputs": {"choice": ["yes", "no", "peut-être"]}},
        )
        assert r.choices[0].text in ("yes", "no", "peut-être")


@pytest.mark.parametrize(
    "body,match",
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                }
            },
            "Unsupported type",
        ),
        ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex"),
        ({"structured_outputs": {"nope": 1}}, "unknown fields"),
        ({"structured_outputs": {"choice": []}}, "non-empty"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "use one of them",
        ),
    ],
)
def test_bad_constraints_are_400(client, body, match):
    with pytest.raises(openai.BadRequestError, match=match):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            extra_body=body,
        )
