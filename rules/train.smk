# Stage 6 - train: one draft per variant with speculators' trainer (train.draft_type, EAGLE-3 by
# default; a type vLLM cannot serve where verify runs is refused at plan time, stages.py); final/ is the
# vLLM-loadable draft (best or last epoch), untrained/ the same draft before any step (the
# verification baseline). Epoch checkpoints live in checkpoints/, outside the declared
# outputs, so an interrupted run resumes from its latest epoch. A variant's draft is built from
# the stage instances its settings name (variant_file, rules/common.smk).
# hidden_states.mode: offline trains on the variant's hidden_states instance; online on its
# tokenized data, with a vLLM server the job starts on its own GPUs (server_gpus of
# resources.train.gpu) and stops however it ends. hidden_states.json records which (and the
# server's layer ids).
# train.max_conversations trains on a nested subset of the conversations (a scratch view in
# checkpoints/data-subset/, pipeline_lib/training/subset.py): sizes share every upstream stage.


rule train_draft:
    input:
        unpack(train_inputs),
    output:
        final=directory(f"{R}/drafts/{{variant}}/final"),
        untrained=directory(f"{R}/drafts/{{variant}}/untrained"),
        metrics=f"{R}/drafts/{{variant}}/train_metrics.csv",
        provenance=f"{R}/drafts/{{variant}}/provenance.json",
        hs_record=f"{R}/drafts/{{variant}}/hidden_states.json",
    params:
        script=script("train_draft.py"),
        gpu_wrapper=script("run_on_gpus.py"),
        settings=lambda wc: variant_settings(wc.variant),
        hs_settings=lambda wc: train_hs_settings(wc.variant),
        source_args=train_source_args,
        code=code_version("train_draft.py", "run_on_gpus.py"),
        checkpoints=lambda wc: f"{R}/drafts/{wc.variant}/checkpoints",
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/train/{{variant}}.log",
    benchmark:
        f"{R}/benchmarks/train/{{variant}}.tsv"
    threads: res("train", "threads")
    resources:
        mem_mb=res("train", "mem_mb"),
        runtime=res("train", "runtime"),
        gpu=res("train", "gpu"),
        nodes=res("train", "nodes"),
    shell:
        "python {params.gpu_wrapper} --gpus {resources.gpu} --"
        " python {params.script} --settings {params.settings:q}"
        " --target {input.target} --target-manifest {input.target_manifest}"
        " --data {input.data} {params.source_args} --hs-settings {params.hs_settings:q}"
        " --tokenized-stats {input.tokenized_stats}"
        " --checkpoints {params.checkpoints} --gpus {resources.gpu} --nodes {resources.nodes}"
        " --final {output.final} --untrained {output.untrained} --metrics {output.metrics}"
        " --provenance {output.provenance} --hs-record {output.hs_record} > {log} 2>&1"


rule load_check:
    input:
        target=f"{R}/target/model",
        draft=f"{R}/drafts/{{variant}}/final",
    output:
        f"{R}/drafts/{{variant}}/load_check.json",
    params:
        script=script("load_check.py"),
        gpu_wrapper=script("run_on_gpus.py"),
        pipeline_parallel=pipeline_parallel("verify"),
        code=code_version("load_check.py", "run_on_gpus.py"),
        draft_type=lambda wc: variant_train(wc.variant)["draft_type"],
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/load_check/{{variant}}.log",
    benchmark:
        f"{R}/benchmarks/load_check/{{variant}}.tsv"
    threads: res("verify", "threads")
    resources:
        mem_mb=res("verify", "mem_mb"),
        runtime=res("verify", "runtime"),
        gpu=res("verify", "gpu"),
    shell:
        "python {params.gpu_wrapper} --gpus {resources.gpu} --pipeline-parallel {params.pipeline_parallel} --"
        " python {params.script} --target {input.target} --draft {input.draft}"
        " --draft-type {params.draft_type} --out {output} > {log} 2>&1"
