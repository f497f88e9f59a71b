"""A Python heap that is still there at exit: N small strings in pymalloc's own arenas
(anonymous mappings, not malloc's blocks), held by one list that outlives the interpreter's
finalization as a leaked reference would. The leak report's root scan reads those arenas
word by word: this is what the benchmark times. Prints when the interpreter starts to exit.

usage: exit_heap.py [N]   (default 3,000,000)"""
import atexit
import ctypes
import sys
import time

count = int(sys.argv[1]) if len(sys.argv) > 1 else 3_000_000
objects = [str(i) for i in range(count)]
# One reference more than anyone drops: the list and its strings survive finalization.
ctypes.pythonapi.Py_IncRef(ctypes.py_object(objects))
atexit.register(lambda: print(f"exits at {time.monotonic():.6f}", flush=True))
