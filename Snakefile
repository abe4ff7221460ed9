# EAGLE-3 draft pipeline: target LLM + prompt set -> trained, verified EAGLE-3 draft for vLLM.
# Read rules/ in this order to see the whole DAG:
#   target -> (synthesize ->) prompts -> traces -> tokenize -> hidden_states -> train -> verify
#   (forecast, optional: target + eval prompts -> the speedup the planned draft would buy)
import os
import sys

from snakemake.utils import min_version, validate

min_version("9.0")

sys.path.insert(0, os.path.join(workflow.basedir, "scripts"))
from pipeline_lib.io import read_text  # noqa: E402


# The demo default, unless the user passes --configfile (then only theirs is read, so a
# config for another target never inherits demo keys by accident).
if not workflow.overwrite_configfiles:
    # Bytes that are not UTF-8 fail here naming line and byte offset (YAML's own reader
    # would end in a codec traceback); a byte-order mark is fine.
    read_text(os.path.join(workflow.basedir, "config.yaml"), "config file")

    configfile: os.path.join(workflow.basedir, "config.yaml")


validate(config, os.path.join(workflow.basedir, "schemas/config.schema.yaml"))


include: "rules/common.smk"


# Credentials come from the environment, never from the config: config values reach every
# job's command line, Snakemake's log and metadata, and provenance
# (pipeline_lib/config_credentials.py).
from pipeline_lib.config_credentials import refuse_credentials_in_config  # noqa: E402

refuse_credentials_in_config(config)

# Every local path the config names must exist before anything is planned: Snakemake keeps a
# finished job whose changed input is missing, so a mistyped target.path would silently leave
# the old target in place (pipeline_lib/config_paths.py).
from pipeline_lib.config_paths import refuse_missing_paths  # noqa: E402

refuse_missing_paths(config)


include: "rules/target.smk"
include: "rules/synthesize.smk"
include: "rules/prompts.smk"
include: "rules/forecast.smk"
include: "rules/traces.smk"
include: "rules/tokenize.smk"
include: "rules/hidden_states.smk"
include: "rules/train.smk"
include: "rules/verify.smk"
include: "rules/plan.smk"


rule all:
    default_target: True
    input:
        all_outputs(),
