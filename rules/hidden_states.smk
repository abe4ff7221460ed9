# Stage 5 - hidden states: the target's hidden states at the aux layers plus the final layer
# (pre-norm) for every tokenized row, as speculators reads them (hs_{i}.safetensors).
# Shards write each file atomically into a store outside the declared outputs (keyed by
# target digest, data digest and layer ids), so reruns validate and keep good files; the
# gather step assembles speculators' data dir from hard links (no copy of the bytes).


rule hidden_states_shard:
    input:
        script=script("extract_hidden_states.py"),
        gpu_wrapper=script("run_on_gpus.py"),
        target=f"{R}/target/model",
        manifest=f"{R}/target/manifest.json",
        data=f"{R}/tokenized/data",
        tokenized_provenance=f"{R}/tokenized/provenance.json",
    output:
        shard=f"{R}/hidden_states/shards/{{shard}}-of-{HS_SHARDS}.json",
    params:
        num_shards=HS_SHARDS,
        settings=lambda wc: settings("hidden_states", trust_remote_code=config["target"]["trust_remote_code"]),
        code=code_version("extract_hidden_states.py"),
        store=f"{R}/hidden_states/store",
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/hidden_states/{{shard}}-of-{HS_SHARDS}.log",
    benchmark:
        f"{R}/benchmarks/hidden_states/{{shard}}-of-{HS_SHARDS}.tsv"
    threads: res("hidden_states", "threads")
    resources:
        mem_mb=res("hidden_states", "mem_mb"),
        runtime=res("hidden_states", "runtime"),
        gpu=res("hidden_states", "gpu"),
    shell:
        "python {input.gpu_wrapper} --gpus {resources.gpu} --"
        " python {input.script} --settings {params.settings:q}"
        " --target {input.target} --manifest {input.manifest} --data {input.data}"
        " --shard {wildcards.shard} --num-shards {params.num_shards} --store-dir {params.store}"
        " --out {output.shard} > {log} 2>&1"


rule hidden_states_gather:
    input:
        script=script("gather_hidden_states.py"),
        shards=hidden_state_shards,
        data=f"{R}/tokenized/data",
        token_freq=f"{R}/tokenized/token_freq.pt",
    output:
        data=directory(f"{R}/hidden_states/data"),
        manifest=f"{R}/hidden_states/manifest.json",
        provenance=f"{R}/hidden_states/provenance.json",
    params:
        code=code_version("gather_hidden_states.py"),
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/hidden_states_gather.log",
    benchmark:
        f"{R}/benchmarks/hidden_states_gather.tsv"
    threads: 1
    shell:
        "python {input.script} --shards {input.shards} --data {input.data}"
        " --token-freq {input.token_freq} --out-data {output.data}"
        " --manifest {output.manifest} --provenance {output.provenance} > {log} 2>&1"
