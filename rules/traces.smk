# Stage 3 - traces: the target's own answers (reasoning captured separately) to the training
# prompts. Scattered into num_shards independent jobs; finished rows live in a row cache
# outside the declared outputs, so a failed or interrupted shard resumes where it stopped
# (Snakemake deletes the declared outputs of failed jobs) and a num_shards change keeps them.


rule traces_shard:
    input:
        script=script("generate_traces.py"),
        gpu_wrapper=script("run_on_gpus.py"),
        target=f"{R}/target/model",
        manifest=f"{R}/target/manifest.json",
        prompts=f"{R}/prompts/train.jsonl",
    output:
        shard=f"{R}/traces/shards/{{shard}}-of-{TRACE_SHARDS}.jsonl",
        summary=f"{R}/traces/shards/{{shard}}-of-{TRACE_SHARDS}.summary.json",
    params:
        num_shards=TRACE_SHARDS,
        settings=lambda wc: settings("generation", trust_remote_code=config["target"]["trust_remote_code"]),
        code=code_version("generate_traces.py"),
        cache=f"{R}/traces/cache",
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/traces/{{shard}}-of-{TRACE_SHARDS}.log",
    benchmark:
        f"{R}/benchmarks/traces/{{shard}}-of-{TRACE_SHARDS}.tsv"
    threads: res("traces", "threads")
    resources:
        mem_mb=res("traces", "mem_mb"),
        runtime=res("traces", "runtime"),
        gpu=res("traces", "gpu"),
    shell:
        "python {input.gpu_wrapper} --gpus {resources.gpu} --"
        " python {input.script} --settings {params.settings:q}"
        " --target {input.target} --manifest {input.manifest} --prompts {input.prompts}"
        " --shard {wildcards.shard} --num-shards {params.num_shards} --cache-dir {params.cache}"
        " --out {output.shard} --summary {output.summary} > {log} 2>&1"


rule traces_gather:
    input:
        script=script("gather_traces.py"),
        shards=trace_shards,
        summaries=trace_shard_summaries,
    output:
        traces=f"{R}/traces/traces.jsonl",
        summary=f"{R}/traces/summary.json",
        provenance=f"{R}/traces/provenance.json",
    params:
        code=code_version("gather_traces.py"),
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/traces_gather.log",
    benchmark:
        f"{R}/benchmarks/traces_gather.tsv"
    threads: 1
    shell:
        "python {input.script} --shards {input.shards} --out {output.traces}"
        " --summary {output.summary} --provenance {output.provenance} > {log} 2>&1"
