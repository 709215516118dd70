"""The trainer inside the trainer image: Megatron-Core GPT pretraining driven by Megatron-LM flags.

Importing the package is cheap and torch-free; `config.parse_args(argv) -> TrainerConfig` is the
contract surface the operator's rendered command line is tested against.
"""
