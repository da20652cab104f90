"""``python -m edgeq.cli ARGS``: the ``edgeq`` command (the same entry point as the installed script)."""

from edgeq.cli.main import main

if __name__ == "__main__":
    main()
