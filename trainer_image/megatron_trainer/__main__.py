"""`python -m megatron_trainer <Megatron-LM flags>` or `python -m megatron_trainer preprocess ...`.

Guarded: dist_checkpointing's async writer uses multiprocessing spawn, which re-imports this module.
"""

import sys


def _run() -> int:
    argv = sys.argv[1:]
    if argv and argv[0] == "preprocess":
        from .preprocess import main as preprocess_main

        return preprocess_main(argv[1:])
    from .main import main

    return main(argv)


if __name__ == "__main__":
    sys.exit(_run())
