# Stage 2 - prompts: load the prompt sets through `datasets`, map their fields to chat
# messages, drop exact duplicates and training prompts that share an n-gram with the eval
# source, split train/eval by seed, cap by num_samples. Train and eval are separate rules so
# that changing how many eval prompts are measured reruns verification only.


rule prompts_train:
    input:
        prompt_source_inputs("train"),
        synthesized_input("train"),
    output:
        prompts=f"{R}/prompts/train.jsonl",
        provenance=f"{R}/prompts/train.provenance.json",
    params:
        script=script("prepare_prompts.py"),
        settings=lambda wc: with_synthesized(prompt_settings("train")),
        packaged_sources=lambda wc: packaged_digests(prompt_source_refs("train")),
        code=code_version("prepare_prompts.py"),
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/prompts_train.log",
    benchmark:
        f"{R}/benchmarks/prompts_train.tsv"
    threads: 1
    resources:
        mem_mb=res("default", "mem_mb"),
        runtime=res("default", "runtime"),
    shell:
        "python {params.script} --split train --settings {params.settings:q}"
        " --out {output.prompts} --provenance {output.provenance} > {log} 2>&1"


rule prompts_eval:
    input:
        prompt_source_inputs("eval"),
        synthesized_input("eval"),
    output:
        prompts=f"{R}/prompts/eval.jsonl",
        provenance=f"{R}/prompts/eval.provenance.json",
    params:
        script=script("prepare_prompts.py"),
        settings=lambda wc: with_synthesized(prompt_settings("eval")),
        packaged_sources=lambda wc: packaged_digests(prompt_source_refs("eval")),
        code=code_version("prepare_prompts.py"),
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/prompts_eval.log",
    benchmark:
        f"{R}/benchmarks/prompts_eval.tsv"
    threads: 1
    resources:
        mem_mb=res("default", "mem_mb"),
        runtime=res("default", "runtime"),
    shell:
        "python {params.script} --split eval --settings {params.settings:q}"
        " --out {output.prompts} --provenance {output.provenance} > {log} 2>&1"
