# Planning: `snakemake plan` writes results/<run>/plan.json (no heavy job runs);
# `snakemake -n` prints the same plan before Snakemake's own job list.


rule plan:
    output:
        f"{R}/plan.json",
    params:
        script=script("plan.py"),
        settings=lambda wc: json.dumps(config, sort_keys=True),
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/plan.log",
    benchmark:
        f"{R}/benchmarks/plan.tsv"
    threads: 1
    shell:
        "python {params.script} --settings {params.settings:q} --results $(dirname {output}) --out {output} 2>&1 | tee {log}"


# Every invocation plans, so what cannot fit is refused before any job runs; a dry run prints the plan.
from pipeline_lib.errors import PipelineError  # noqa: E402
from pipeline_lib.plan import check_fits, format_plan, make_plan  # noqa: E402

PLAN = make_plan(config, R)
if invoked_as_dry_run():
    print(format_plan(PLAN), file=sys.stderr)
try:
    check_fits(config, PLAN)
except PipelineError as err:
    sys.exit(f"ERROR: {err}")  # the message alone: it names the stage, the setting and the numbers
