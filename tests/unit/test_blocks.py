"""The spec's blocks (operator/megatron_operator/blocks/): each is reached through the package, and what it
brings is collected, so a block written but left out of a collector cannot pass unnoticed."""

from __future__ import annotations

import pkgutil

from megatron_operator import blocks, guardrails, rules


def _blocks():
    return [getattr(blocks, m.name, None) for m in pkgutil.iter_modules(blocks.__path__)]


def test_every_block_module_is_imported_by_the_package():
    found = [m.name for m in pkgutil.iter_modules(blocks.__path__)]
    assert found and all(b is not None for b in _blocks()), found


def test_every_blocks_rules_and_guardrails_are_collected_once():
    for block in _blocks():
        for mine, collected in ((getattr(block, "RULES", []), rules.SPEC_RULES),
                                (getattr(block, "OBJECT_RULES", []), rules.OBJECT_RULES),
                                (getattr(block, "GUARDRAILS", ()), guardrails.GUARDRAILS)):
            for item in mine:
                assert sum(c is item for c in collected) == 1, (block.__name__, item)
        if getattr(block, "GUARDRAILS", ()):
            assert callable(block.guardrail_violations), block.__name__
    names = [r.name for r in rules.SPEC_RULES + rules.OBJECT_RULES]
    assert len(names) == len(set(names))
