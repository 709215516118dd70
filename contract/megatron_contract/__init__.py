"""What the operator and the trainer both read, written once: the standard library only.

Both ``megatron_operator`` and ``megatron_trainer`` import this package; it imports neither
(import-linter contracts in pyproject.toml). The operator and the trainer still never import each
other: their contract is the rendered command line (docs/trainer-contract.md).
"""
