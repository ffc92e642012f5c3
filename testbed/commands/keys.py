"""`testbed keys`: every experiment YAML key with its default and meaning (Markdown table).

The table in experiments/README.md is this command's output; a test keeps the two in step.
"""

from testbed.config import Experiment
from testbed.schema import describe


def markdown():
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for key, default, doc in describe(Experiment):
        if default is None:
            shown = ""
        elif isinstance(default, float) and default >= 1e6:
            shown = f"{default:.3g}"
        else:
            shown = str(default)
        lines.append(f"| `{key}` | {shown} | {doc.replace('|', '/')} |")
    return "\n".join(lines)


def register(sub):
    p = sub.add_parser("keys", help="print every experiment YAML key (Markdown)")
    p.set_defaults(func=main)


def main(args):
    print(markdown())
    return 0
