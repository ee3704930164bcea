"""Run the kvstore command from a checkout: ``python cli.py --help``.

The command itself lives in kvstore/cli.py so that installing the package
adds no generic top-level module named ``cli``.
"""

from kvstore.cli import main

if __name__ == "__main__":
    main()
