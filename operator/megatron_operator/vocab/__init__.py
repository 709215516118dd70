"""The shared vocabulary of the spec (pure): what the core files and every block (``blocks/``) are written in.

- ``patterns``: the field patterns (regular expressions) of the schema and the rules;
- ``api``: ``ApiModel``, the base of every spec model, and the small models several blocks share;
- ``values``: the spec's shared values as expressions (the layout, the effective model);
- ``rule``: ``Rule`` and ``Problem``, and the helpers rules are built from;
- ``guardrail``: ``Guardrail``, a cluster admin's rule, and the helpers of its Python twin.

It imports nothing of the operator above ``names``, ``presets``, ``expr`` and ``settings``: the collectors
(``spec``, ``rules``, ``guardrails``, ``render``) and the blocks import it, never the reverse (import-linter,
pyproject.toml).
"""
