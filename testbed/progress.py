"""The runner's progress bar: completed requests counted in requests.jsonl as the client
appends them (`testbed.records.done_outcomes`), shown with tqdm on standard error."""

import sys

from tqdm import tqdm

from testbed.records import done_outcomes


class Progress:
    """Counts completed requests in requests.jsonl as the client appends them; a tqdm bar."""

    def __init__(self, path, total, label, enabled=True):
        self.path, self.total = path, total
        self.pos = 0
        self.done = 0
        self.failed = 0
        self.bar = None
        if enabled:
            self.bar = tqdm(total=total, desc=f"{label:>12}", unit="req", file=sys.stderr,
                            dynamic_ncols=True, leave=True)

    def poll(self):
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self.pos)
            chunk = f.read()
        complete = chunk[:chunk.rfind("\n") + 1]
        self.pos += len(complete.encode())
        for ok in done_outcomes(complete.splitlines()):
            self.done += 1
            if not ok:
                self.failed += 1
            if self.bar:
                self.bar.update(1)
                self.bar.set_postfix(failed=self.failed, refresh=False)

    def write(self, msg):
        (self.bar.write if self.bar else print)(msg, file=sys.stderr)

    def close(self):
        if self.bar:
            self.bar.close()
