# Stage 4 - tokenize: render each trace with the target's chat template (reasoning where the
# template puts it), build the assistant-only loss mask, write speculators' training data
# (save_to_disk: input_ids, loss_mask, seq_len) and token_freq.pt over loss-masked tokens.
# {tokenized} is the instance's directory; it reads the traces instance its chain names.


rule tokenize:
    input:
        target=f"{R}/target/model",
        manifest=f"{R}/target/manifest.json",
        traces=upstream_file("tokenized", "traces.jsonl"),
    output:
        data=directory(f"{R}/{{tokenized}}/data"),
        token_freq=f"{R}/{{tokenized}}/token_freq.pt",
        stats=f"{R}/{{tokenized}}/stats.json",
        provenance=f"{R}/{{tokenized}}/provenance.json",
    params:
        script=script("tokenize_traces.py"),
        # tokenize's section plus what it takes from others (pipeline_lib/stages.py STAGES).
        settings=instance_settings("tokenized"),
        code=code_version("tokenize_traces.py"),
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/{{tokenized}}.log",
    benchmark:
        f"{R}/benchmarks/{{tokenized}}.tsv"
    threads: res("default", "threads")
    resources:
        mem_mb=res("default", "mem_mb"),
        runtime=res("default", "runtime"),
    shell:
        "python {params.script} --settings {params.settings:q}"
        " --target {input.target} --manifest {input.manifest} --traces {input.traces}"
        " --out-data {output.data} --token-freq {output.token_freq} --stats {output.stats}"
        " --provenance {output.provenance} > {log} 2>&1"
