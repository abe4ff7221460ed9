"""The verification report of one draft variant (scripts/make_report.py is the rule's entry
point): what it reads and computes, and its sections, one module each, in reading order
(document.SECTIONS):

  headline    the verdict and the one table a user reads first, how to read the rest
  verdict     thresholds (verify.thresholds) and PASS/FAIL with its reasons
  suites      tau per eval suite with bootstrap intervals, categories, degenerate answers, overlap
  acceptance  trained vs untrained draft, greedy equality, per category, reasoning/answer spans
  throughput  tokens/s with and without the draft, the speedup with its interval or why not measured
  contract    the contract checks and the reference draft
  training    train_metrics.csv: loss and accuracy per epoch, the selected epoch
  lineage     the stage instances the draft was built from
  provenance  the chain of provenance records, re-checked against the disk

plots.py draws the figures the sections name; document.py puts the sections in order."""
from .document import SECTIONS, build_sections  # noqa: F401
from .plots import make_plots  # noqa: F401
from .provenance import measured_from_records, provenance_summary  # noqa: F401
from .suites import suites_summary  # noqa: F401
from .training import load_metrics, training_summary  # noqa: F401
from .verdict import evaluate_thresholds, verdict  # noqa: F401
