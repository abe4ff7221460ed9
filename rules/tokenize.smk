# Stage 4 - tokenize: render each trace with the target's chat template (reasoning where the
# template puts it), build the assistant-only loss mask, write speculators' training data
# (save_to_disk: input_ids, loss_mask, seq_len) and token_freq.pt over loss-masked tokens.


rule tokenize:
    input:
        script=script("tokenize_traces.py"),
        target=f"{R}/target/model",
        manifest=f"{R}/target/manifest.json",
        traces=f"{R}/traces/traces.jsonl",
    output:
        data=directory(f"{R}/tokenized/data"),
        token_freq=f"{R}/tokenized/token_freq.pt",
        stats=f"{R}/tokenized/stats.json",
        provenance=f"{R}/tokenized/provenance.json",
    params:
        # The mask must render with the template arguments generation used (e.g. enable_thinking).
        settings=lambda wc: settings(
            "tokenize",
            trust_remote_code=config["target"]["trust_remote_code"],
            chat_template_kwargs=config["generation"]["chat_template_kwargs"],
        ),
        code=code_version("tokenize_traces.py"),
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/tokenize.log",
    benchmark:
        f"{R}/benchmarks/tokenize.tsv"
    threads: res("default", "threads")
    resources:
        mem_mb=res("default", "mem_mb"),
        runtime=res("default", "runtime"),
    shell:
        "python {input.script} --settings {params.settings:q}"
        " --target {input.target} --manifest {input.manifest} --traces {input.traces}"
        " --out-data {output.data} --token-freq {output.token_freq} --stats {output.stats}"
        " --provenance {output.provenance} > {log} 2>&1"
