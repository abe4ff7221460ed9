#!/usr/bin/env python
import os, sys
args = sys.argv[sys.argv.index("--") + 1:]
os.execvp(args[0], args)
