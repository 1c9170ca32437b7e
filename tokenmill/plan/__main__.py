"""``python -m tokenmill.plan``: the planner without the tokenmill CLI around it."""

import argparse

from .cli import add_arguments, run

parser = argparse.ArgumentParser(prog="tokenmill plan", description=__doc__)
add_arguments(parser)
raise SystemExit(run(parser.parse_args()))
