# Stage 7 - verify: contract checks (format, layer ids, vocab maps, embeddings, digests),
# acceptance measured in real vLLM (trained vs untrained draft vs no speculation), and the
# report people read. A draft vLLM cannot load still gets a report stating vLLM's message.


rule contract_checks:
    input:
        script=script("check_contract.py"),
        target=f"{R}/target/model",
        target_manifest=f"{R}/target/manifest.json",
        draft=f"{R}/drafts/{{variant}}/final",
        hs_manifest=f"{R}/hidden_states/manifest.json",
        tokenized_stats=f"{R}/tokenized/stats.json",
    output:
        f"{R}/drafts/{{variant}}/verify/contract.json",
    params:
        # Only what the checks read: a change of k or thresholds must not rerun them.
        settings=lambda wc: json.dumps({"reference_draft": config["verify"]["reference_draft"]}),
        code=code_version("check_contract.py"),
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/contract_checks/{{variant}}.log",
    benchmark:
        f"{R}/benchmarks/contract_checks/{{variant}}.tsv"
    threads: 1
    resources:
        mem_mb=res("default", "mem_mb"),
        runtime=res("default", "runtime"),
    shell:
        "python {input.script} --settings {params.settings:q}"
        " --target {input.target} --target-manifest {input.target_manifest}"
        " --draft {input.draft} --hs-manifest {input.hs_manifest}"
        " --tokenized-stats {input.tokenized_stats} --out {output} > {log} 2>&1"


rule acceptance:
    input:
        script=script("measure_acceptance.py"),
        gpu_wrapper=script("run_on_gpus.py"),
        target=f"{R}/target/model",
        draft=f"{R}/drafts/{{variant}}/final",
        untrained=f"{R}/drafts/{{variant}}/untrained",
        prompts=f"{R}/prompts/eval.jsonl",
    output:
        f"{R}/drafts/{{variant}}/verify/acceptance.json",
    params:
        settings=lambda wc: acceptance_settings(),
        code=code_version("measure_acceptance.py"),
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/acceptance/{{variant}}.log",
    benchmark:
        f"{R}/benchmarks/acceptance/{{variant}}.tsv"
    threads: res("verify", "threads")
    resources:
        mem_mb=res("verify", "mem_mb"),
        runtime=res("verify", "runtime"),
        gpu=res("verify", "gpu"),
    shell:
        "python {input.gpu_wrapper} --gpus {resources.gpu} --"
        " python {input.script} --settings {params.settings:q}"
        " --target {input.target} --draft {input.draft} --untrained {input.untrained}"
        " --prompts {input.prompts} --out {output} > {log} 2>&1"


rule report:
    input:
        script=script("make_report.py"),
        contract=f"{R}/drafts/{{variant}}/verify/contract.json",
        acceptance=f"{R}/drafts/{{variant}}/verify/acceptance.json",
        metrics=f"{R}/drafts/{{variant}}/train_metrics.csv",
        provenance=lambda wc: provenance_chain(wc.variant),
    output:
        verification=report(f"{R}/drafts/{{variant}}/report/verification.json", category="Verification", labels={"variant": "{variant}", "file": "verification.json"}),
        markdown=report(f"{R}/drafts/{{variant}}/report/report.md", category="Verification", labels={"variant": "{variant}", "file": "report.md"}),
        html=report(f"{R}/drafts/{{variant}}/report/report.html", category="Verification", labels={"variant": "{variant}", "file": "report.html"}),
    params:
        settings=lambda wc: settings("verify"),
        code=code_version("make_report.py"),
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/report/{{variant}}.log",
    benchmark:
        f"{R}/benchmarks/report/{{variant}}.tsv"
    threads: 1
    resources:
        mem_mb=res("default", "mem_mb"),
        runtime=res("default", "runtime"),
    shell:
        "python {input.script} --settings {params.settings:q} --variant {wildcards.variant}"
        " --contract {input.contract} --acceptance {input.acceptance} --metrics {input.metrics}"
        " --provenance {input.provenance} --out-dir $(dirname {output.verification})"
        " > {log} 2>&1"


rule compare_variants:
    input:
        script=script("compare_variants.py"),
        reports=expand(f"{R}/drafts/{{variant}}/report/verification.json", variant=VARIANTS),
    output:
        report(f"{R}/drafts/comparison.csv", category="Verification", labels={"file": "comparison.csv"}),
    params:
        code=code_version("compare_variants.py"),
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/compare_variants.log",
    benchmark:
        f"{R}/benchmarks/compare_variants.tsv"
    threads: 1
    shell:
        "python {input.script} --reports {input.reports} --out {output} > {log} 2>&1"
