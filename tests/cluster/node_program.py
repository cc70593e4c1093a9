"""Torch-free node program for the failure, timeout and signal tests:
`node_program.py MODE TOKEN`. MODE `fail` makes node 1 exit with code 3 at once while the
others sleep; `sleep` sleeps on every node. Either way the sleepers would run for 10
minutes if the launcher did not stop them. TOKEN only marks the command line, so a test
can look for surviving processes of its own run."""

import os
import sys
import time

mode = sys.argv[1]
node = int(os.environ["DHELIX_NODE_RANK"])
print(f"node {node} started ({mode})", flush=True)
if mode == "fail" and node == 1:
    sys.exit(3)
time.sleep(600)
