"""The spec's blocks: one module per ``spec.*`` block that touches several stages (its room).

A block module holds, for its part of the spec:

- its schema: the pydantic models (on ``vocab.api.ApiModel``);
- its admission rules: ``RULES`` (on spec) and ``OBJECT_RULES`` (on the whole MegatronJob), ``vocab.rule.Rule``s;
- its guardrails: ``GUARDRAILS`` and their Python twin, a function that yields ``vocab.guardrail.Violation``s;
- its part of the rendered objects: pure builders that take the block's own models and return (or add to) the
  pod, the container's volumes, mounts and env, and the trainer's flags.

It is written in the shared vocabulary (``vocab/``) and in ``names``, ``expr``, ``settings``; it never imports a
collector (``spec``, ``rules``, ``guardrails``, ``render``, or anything above them) nor another block
(import-linter, pyproject.toml). The collectors import the blocks and place what each gives.

How to add a block (``spec.cpu``, say):

1. Write ``blocks/cpu.py`` with the four parts above (leave out those the block has none of).
2. ``spec.py``: import the block's top model, and give ``MegatronJobSpec`` the field (its place among the fields
   is its place in the CRD).
3. ``rules.py``: import the block and add its ``RULES`` (and ``OBJECT_RULES``) to the collected list at the end
   (the order of the list is the order of the CRD's rules).
4. ``guardrails.py``: add its ``GUARDRAILS`` to the table and call its Python twin in ``_violations``; then
   ``python scripts/gen-chart-guardrails.py`` (the chart's policy is generated from the table).
5. ``render.py``: call its builders where their output goes (a flag the trainer gets also goes into
   ``rules.RENDERED_FLAGS``, the contract table ``tests/test_contract.py`` checks the rendering against; an
   operator volume into ``names.OPERATOR_VOLUME_MOUNTS``).
6. ``.venv/bin/megatron-operator crd > crds/megatron-operator.io_megatronjobs.yaml`` and
   ``python scripts/gen-chart-crd.py``; tests for the block go beside its stage's (tests/unit/spec_table.py
   for its rules, test_render.py for its rendering).
"""

from . import hf, object_store, pod, wandb  # noqa: F401  (the collectors reach each block as blocks.<name>)
