# Stage synthesize (runs only when a prompts.train source is `synthesized`): the target writes
# user requests through its own chat template, rendered up to the opening of a user turn (the
# Magpie method). Scattered into synthesize.num_shards jobs with a row cache outside the
# declared outputs, as traces are (a failed or interrupted shard resumes where it stopped);
# the gather filters the candidates (length, language, near-duplicates, template markers,
# refusals) and decontaminates them against every eval suite, counting each filter's drops.

rule synthesize_shard:
    input:
        target=f"{R}/target/model",
        manifest=f"{R}/target/manifest.json",
    output:
        shard=f"{R}/synthesized/shards/{{shard}}-of-{{num_shards}}.jsonl",
        summary=f"{R}/synthesized/shards/{{shard}}-of-{{num_shards}}.summary.json",
    params:
        script=script("synthesize_prompts.py"),
        gpu_wrapper=script("run_on_gpus.py"),
        pipeline_parallel=pipeline_parallel("synthesize"),
        settings=lambda wc: synthesis_settings(),
        code=code_version("synthesize_prompts.py", "run_on_gpus.py"),
        cache=f"{R}/synthesized/cache",
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/synthesized/{{shard}}-of-{{num_shards}}.log",
    benchmark:
        f"{R}/benchmarks/synthesized/{{shard}}-of-{{num_shards}}.tsv"
    threads: res("synthesize", "threads")
    resources:
        mem_mb=res("synthesize", "mem_mb"),
        runtime=res("synthesize", "runtime"),
        gpu=res("synthesize", "gpu"),
    shell:
        "python {params.gpu_wrapper} --gpus {resources.gpu} --pipeline-parallel {params.pipeline_parallel} --"
        " python {params.script} --settings {params.settings:q}"
        " --target {input.target} --manifest {input.manifest}"
        " --shard {wildcards.shard} --num-shards {wildcards.num_shards} --cache-dir {params.cache}"
        " --out {output.shard} --summary {output.summary} > {log} 2>&1"


rule synthesize_gather:
    input:
        shards=synthesis_shards(".jsonl"),
        summaries=synthesis_shards(".summary.json"),
        suites=lambda wc: local_files([e["source"] for e in synthesis_suites()]),
    output:
        prompts=SYNTHESIZED,
        summary=f"{R}/synthesized/summary.json",
        provenance=f"{R}/synthesized/provenance.json",
    params:
        script=script("gather_synthesized.py"),
        settings=lambda wc: synthesis_gather_settings(),
        packaged_sources=lambda wc: packaged_digests([e["source"] for e in synthesis_suites()]),
        code=code_version("gather_synthesized.py"),
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/synthesized_gather.log",
    benchmark:
        f"{R}/benchmarks/synthesized_gather.tsv"
    threads: 1
    resources:
        mem_mb=res("default", "mem_mb"),
        runtime=res("default", "runtime"),
    shell:
        "python {params.script} --settings {params.settings:q} --shards {input.shards}"
        " --out {output.prompts} --summary {output.summary} --provenance {output.provenance} > {log} 2>&1"
