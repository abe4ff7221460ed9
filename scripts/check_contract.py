#!/usr/bin/env python
raise SystemExit("not implemented yet")
