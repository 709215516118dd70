"""The trainer inside the trainer image: Megatron-Core GPT pretraining and supervised fine-tuning, driven by
Megatron-LM flags, from and to Hugging Face checkpoints, with checkpoints on a directory or in S3.

Importing the package is cheap and torch-free; `config.parse_args(argv) -> TrainerConfig` is the
contract surface the operator's rendered command line is tested against.
"""
