# Stage 3 - traces: the target's own answers (reasoning captured separately) to the training
# prompts. Scattered into num_shards independent jobs; finished rows live in a row cache
# outside the declared outputs, so a failed or interrupted shard resumes where it stopped
# (Snakemake deletes the declared outputs of failed jobs) and a num_shards change keeps them.
# {traces} is the instance's directory: `traces` for the base config, traces-<digest> for a
# variant whose generation settings differ (rules/common.smk, pipeline_lib/stages.py).


rule traces_shard:
    input:
        target=f"{R}/target/model",
        manifest=f"{R}/target/manifest.json",
        prompts=f"{R}/prompts/train.jsonl",
    output:
        shard=f"{R}/{{traces}}/shards/{{shard}}-of-{{num_shards}}.jsonl",
        summary=f"{R}/{{traces}}/shards/{{shard}}-of-{{num_shards}}.summary.json",
    params:
        script=script("generate_traces.py"),
        gpu_wrapper=script("run_on_gpus.py"),
        pipeline_parallel=pipeline_parallel("traces"),
        settings=instance_settings("traces"),
        code=code_version("generate_traces.py", "run_on_gpus.py"),
        cache=lambda wc: f"{R}/{wc.traces}/cache",
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/{{traces}}/{{shard}}-of-{{num_shards}}.log",
    benchmark:
        f"{R}/benchmarks/{{traces}}/{{shard}}-of-{{num_shards}}.tsv"
    threads: res("traces", "threads")
    resources:
        mem_mb=res("traces", "mem_mb"),
        runtime=res("traces", "runtime"),
        gpu=res("traces", "gpu"),
    shell:
        "python {params.gpu_wrapper} --gpus {resources.gpu} --pipeline-parallel {params.pipeline_parallel} --"
        " python {params.script} --settings {params.settings:q}"
        " --target {input.target} --manifest {input.manifest} --prompts {input.prompts}"
        " --shard {wildcards.shard} --num-shards {wildcards.num_shards} --cache-dir {params.cache}"
        " --out {output.shard} --summary {output.summary} > {log} 2>&1"


rule traces_gather:
    input:
        shards=shard_files("traces", ".jsonl"),
        summaries=shard_files("traces", ".summary.json"),
    output:
        traces=f"{R}/{{traces}}/traces.jsonl",
        summary=f"{R}/{{traces}}/summary.json",
        provenance=f"{R}/{{traces}}/provenance.json",
    params:
        script=script("gather_traces.py"),
        code=code_version("gather_traces.py"),
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/{{traces}}_gather.log",
    benchmark:
        f"{R}/benchmarks/{{traces}}_gather.tsv"
    threads: 1
    shell:
        "python {params.script} --shards {input.shards} --out {output.traces}"
        " --summary {output.summary} --provenance {output.provenance} > {log} 2>&1"
