"""`python -m runtime ...`: the same command line as `overlap ...`."""

from runtime.cli import main_entry

if __name__ == "__main__":
    main_entry()
