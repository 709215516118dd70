"""megatron-operator: runs NVIDIA Megatron-Core LLM training as a Kubernetes MegatronJob."""

__version__ = "0.1.0"
