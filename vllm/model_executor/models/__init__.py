from vllm.model_executor.models.glm_moe_dsa import GlmMoeDsaForCausalLM

MODEL_REGISTRY = {"GlmMoeDsaForCausalLM": GlmMoeDsaForCausalLM}
