"""`--speculative-config`: MTP speculative decoding (upstream's keys).

``{"method": "mtp", "num_speculative_tokens": 1..3}`` drafts that many tokens per step with the
checkpoint's MTP layer and verifies them in the next step's target forward. One extra key, ours:
``synthetic_acceptance_length`` (a float in [1, num_speculative_tokens + 1]) makes every
verification accept a fixed mean number of tokens per step instead of comparing tokens — for
benchmarks on random-weight checkpoints, which otherwise accept almost nothing (SPEC §8: the seed
assumes 2.99). Outputs are then *not* the model's; the engine says so in the log and the
benchmark in its report.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.config.flags import parse_json_flag

METHODS = ("mtp",)
# upstream's per-model aliases of the MTP method, accepted and mapped to "mtp"
METHOD_ALIASES = {"deepseek_mtp": "mtp", "glm4_moe_mtp": "mtp", "glm_moe_dsa_mtp": "mtp"}
MAX_SPEC_TOKENS = 3


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "mtp"
    num_speculative_tokens: int = 1
    synthetic_acceptance_length: float | None = None

    @classmethod
    def from_json(cls, value) -> SpeculativeConfig | None:
        raw = parse_json_flag(value, "--speculative-config")
        if not raw:
            return None
        known = {"method", "num_speculative_tokens", "synthetic_acceptance_length"}
        bad = set(raw) - known
        if bad:
            raise ValueError(
                f"--speculative-config: unknown keys {sorted(bad)} (known: {sorted(known)})"
            )
        method = raw.get("method", "mtp")
        if not isinstance(method, str) or METHOD_ALIASES.get(method, method) not in METHODS:
            raise ValueError(
                f"--speculative-config method must be one of {list(METHODS)} (or "
                f"{sorted(METHOD_ALIASES)}), got {method!r}"
            )
        if "num_speculative_tokens" not in raw:
            raise ValueError("--speculative-config needs num_speculative_tokens (1-3)")
        k = raw["num_speculative_tokens"]
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPEC_TOKENS:
            raise ValueError(
                f"--speculative-config num_speculative_tokens must be an integer in "
                f"1..{MAX_SPEC_TOKENS}, got {k!r}"
            )
        synth = raw.get("synthetic_acceptance_length")
        if synth is not None:
            if isinstance(synth, bool) or not isinstance(synth, int | float):
                raise ValueError(
                    "--speculative-config synthetic_acceptance_length must be a number"
                )
            if not 1.0 <= synth <= k + 1:
                raise ValueError(
                    f"--speculative-config synthetic_acceptance_length must be in [1, "
                    f"num_speculative_tokens + 1 = {k + 1}], got {synth}"
                )
            synth = float(synth)
        return cls(
            method=METHOD_ALIASES.get(method, method),
            num_speculative_tokens=k,
            synthetic_acceptance_length=synth,
        )
