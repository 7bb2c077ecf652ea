"""Each rank writes many lines in pieces, straight to fd 1 (unbuffered, several writes a line), while the
other rank does the same: a tee that passes pieces through glues lines of the two ranks."""
import os
import sys

rank = os.environ["RANK"]
n = int(sys.argv[1])
for i in range(n):
    os.write(1, f"r{rank} line {i} ".encode())
    os.sched_yield()
    os.write(1, b"x" * (i % 7 + 1))
    os.sched_yield()
    os.write(1, b" end\n")
