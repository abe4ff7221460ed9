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


if invoked_as_dry_run():
    from pipeline_lib.plan import format_plan, make_plan

    print(format_plan(make_plan(config, R)), file=sys.stderr)
