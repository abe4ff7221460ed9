# Stage 5 - hidden states: the target's hidden states at the aux layers plus the final layer
# (pre-norm) for every tokenized row, as speculators reads them (hs_{i}.safetensors).
# Shards write each file atomically into a store outside the declared outputs (keyed by
# target digest, data digest and layer ids), so reruns validate and keep good files; the
# gather step assembles speculators' data dir from hard links (no copy of the bytes).
# {hidden_states} is the instance's directory; it reads the tokenized instance its chain names.
# Files are written in the storage format (hidden_states.storage: bf16 | fp8). A variant that
# trains online (hidden_states.mode: online) has no instance here: train_draft asks a vLLM server.


rule hidden_states_shard:
    input:
        target=f"{R}/target/model",
        manifest=f"{R}/target/manifest.json",
        data=upstream_file("hidden_states", "data"),
        tokenized_provenance=upstream_file("hidden_states", "provenance.json"),
    output:
        shard=f"{R}/{{hidden_states}}/shards/{{shard}}-of-{{num_shards}}.json",
    params:
        script=script("extract_hidden_states.py"),
        gpu_wrapper=script("run_on_gpus.py"),
        pipeline_parallel=pipeline_parallel("hidden_states"),
        settings=instance_settings("hidden_states"),
        code=code_version("extract_hidden_states.py", "run_on_gpus.py"),
        store=lambda wc: f"{R}/{wc.hidden_states}/store",
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/{{hidden_states}}/{{shard}}-of-{{num_shards}}.log",
    benchmark:
        f"{R}/benchmarks/{{hidden_states}}/{{shard}}-of-{{num_shards}}.tsv"
    threads: res("hidden_states", "threads")
    resources:
        mem_mb=res("hidden_states", "mem_mb"),
        runtime=res("hidden_states", "runtime"),
        gpu=res("hidden_states", "gpu"),
    shell:
        "python {params.gpu_wrapper} --gpus {resources.gpu} --pipeline-parallel {params.pipeline_parallel} --"
        " python {params.script} --settings {params.settings:q}"
        " --target {input.target} --manifest {input.manifest} --data {input.data}"
        " --shard {wildcards.shard} --num-shards {wildcards.num_shards} --store-dir {params.store}"
        " --out {output.shard} > {log} 2>&1"


rule hidden_states_gather:
    input:
        shards=shard_files("hidden_states", ".json"),
        data=upstream_file("hidden_states", "data"),
        token_freq=upstream_file("hidden_states", "token_freq.pt"),
    output:
        data=directory(f"{R}/{{hidden_states}}/data"),
        manifest=f"{R}/{{hidden_states}}/manifest.json",
        provenance=f"{R}/{{hidden_states}}/provenance.json",
    params:
        script=script("gather_hidden_states.py"),
        code=code_version("gather_hidden_states.py"),
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/{{hidden_states}}_gather.log",
    benchmark:
        f"{R}/benchmarks/{{hidden_states}}_gather.tsv"
    threads: 1
    shell:
        "python {params.script} --shards {input.shards} --data {input.data}"
        " --token-freq {input.token_freq} --out-data {output.data}"
        " --manifest {output.manifest} --provenance {output.provenance} > {log} 2>&1"
