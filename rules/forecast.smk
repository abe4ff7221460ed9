# Stage 0 (optional, before any data) - forecast: will the draft this run trains pay for its
# target? vLLM serves the target without a draft and with the planned draft at synthetic
# acceptance lengths; GuideLLM measures each arm at several requests in flight. Off the default
# target unless forecast.enabled; `snakemake results/<run>/forecast/forecast.json` builds it.


rule forecast:
    input:
        target=f"{R}/target/model",
        # The eval prompts (MT-Bench in the shipped configs): what a user's chat traffic looks like.
        prompts=f"{R}/prompts/eval.jsonl",
    output:
        forecast=f"{R}/forecast/forecast.json",
        table=f"{R}/forecast/forecast.md",
        plot=f"{R}/forecast/forecast.png",
    params:
        script=script("forecast_speedup.py"),
        gpu_wrapper=script("run_on_gpus.py"),
        pipeline_parallel=pipeline_parallel("forecast"),
        settings=lambda wc: forecast_settings(),
        work=f"{R}/logs/forecast/work",
        code=code_version("forecast_speedup.py", "run_on_gpus.py"),
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/forecast/forecast.log",
    benchmark:
        f"{R}/benchmarks/forecast/forecast.tsv"
    threads: res("forecast", "threads")
    resources:
        mem_mb=res("forecast", "mem_mb"),
        runtime=res("forecast", "runtime"),
        gpu=res("forecast", "gpu"),
    shell:
        "python {params.gpu_wrapper} --gpus {resources.gpu} --pipeline-parallel {params.pipeline_parallel} --"
        " python {params.script} --settings {params.settings:q} --target {input.target}"
        " --prompts {input.prompts} --out {output.forecast} --table {output.table} --plot {output.plot}"
        " --work {params.work} > {log} 2>&1"
