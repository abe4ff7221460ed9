# Stage 7 - verify: contract checks (format, layer ids, vocab maps, embeddings, digests),
# acceptance measured in real vLLM (trained vs untrained draft vs no speculation: the target
# alone measured once per set of baseline settings, shared by the variants), and the
# report people read. A draft vLLM cannot load still gets a report stating vLLM's message.
# The speedup is measured inside the acceptance job (interleaved rounds), never across jobs.
from pipeline_lib.acceptance.job import with_speedup_settings


rule contract_checks:
    input:
        target=f"{R}/target/model",
        target_manifest=f"{R}/target/manifest.json",
        draft=f"{R}/drafts/{{variant}}/final",
        hs_manifest=lambda wc: hs_manifest_for(wc.variant),
        hs_record=f"{R}/drafts/{{variant}}/hidden_states.json",
        tokenized_stats=variant_file("tokenized", "stats.json"),
        # Train vs serve: sampled training rows against vLLM's render of their conversations.
        tokenized_data=variant_file("tokenized", "data"),
        traces=variant_file("traces", "traces.jsonl"),
    output:
        f"{R}/drafts/{{variant}}/verify/contract.json",
    params:
        # Only what the checks read: a change of k or thresholds must not rerun them.
        script=script("check_contract.py"),
        settings=lambda wc: contract_settings(wc.variant),
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
        "python {params.script} --settings {params.settings:q}"
        " --target {input.target} --target-manifest {input.target_manifest}"
        " --draft {input.draft} --hs-manifest {input.hs_manifest} --hs-record {input.hs_record}"
        " --tokenized-stats {input.tokenized_stats} --tokenized-data {input.tokenized_data}"
        " --traces {input.traces} --out {output} > {log} 2>&1"


rule eval_suite:
    input:
        lambda wc: local_files([suite_entries()[wc.suite]["source"]]),
        train_prompts=f"{R}/prompts/train.jsonl",
    output:
        prompts=f"{R}/eval_suites/{{suite}}/prompts.jsonl",
        overlap=f"{R}/eval_suites/{{suite}}/overlap.json",
    params:
        script=script("prepare_eval_suite.py"),
        settings=lambda wc: suite_settings(wc.suite),
        packaged_sources=lambda wc: packaged_digests([suite_entries()[wc.suite]["source"]]),
        code=code_version("prepare_eval_suite.py"),
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/eval_suite/{{suite}}.log",
    benchmark:
        f"{R}/benchmarks/eval_suite/{{suite}}.tsv"
    threads: 1
    resources:
        mem_mb=res("default", "mem_mb"),
        runtime=res("default", "runtime"),
    shell:
        "python {params.script} --settings {params.settings:q} --train-prompts {input.train_prompts}"
        " --out {output.prompts} --overlap {output.overlap} > {log} 2>&1"


rule acceptance_baseline:
    input:
        target=f"{R}/target/model",
        prompts=f"{R}/prompts/eval.jsonl",
        suites=lambda wc: list(suite_prompt_files().values()),
    output:
        f"{R}/verify/baseline/{{baseline}}.json",
    params:
        script=script("measure_baseline.py"),
        gpu_wrapper=script("run_on_gpus.py"),
        pipeline_parallel=pipeline_parallel("verify"),
        settings=lambda wc: baseline_settings_for_key(wc.baseline),
        suites=lambda wc: suite_flags(),
        code=code_version("measure_baseline.py", "run_on_gpus.py"),
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/acceptance_baseline/{{baseline}}.log",
    benchmark:
        f"{R}/benchmarks/acceptance_baseline/{{baseline}}.tsv"
    threads: res("verify", "threads")
    resources:
        mem_mb=res("verify", "mem_mb"),
        runtime=res("verify", "runtime"),
        gpu=res("verify", "gpu"),
    shell:
        "python {params.gpu_wrapper} --gpus {resources.gpu} --pipeline-parallel {params.pipeline_parallel} --"
        " python {params.script} --settings {params.settings:q}"
        " --target {input.target} --prompts {input.prompts} {params.suites} --out {output} > {log} 2>&1"


rule acceptance:
    input:
        target=f"{R}/target/model",
        draft=f"{R}/drafts/{{variant}}/final",
        untrained=f"{R}/drafts/{{variant}}/untrained",
        prompts=f"{R}/prompts/eval.jsonl",
        suites=lambda wc: list(suite_prompt_files().values()),
        # The target alone, shared by every variant with the same baseline settings.
        baseline=lambda wc: baseline_file(wc.variant),
    output:
        f"{R}/drafts/{{variant}}/verify/acceptance.json",
    params:
        script=script("measure_acceptance.py"),
        gpu_wrapper=script("run_on_gpus.py"),
        pipeline_parallel=pipeline_parallel("verify"),
        # The speedup rounds' settings: only this job reads them (not the shared baseline).
        settings=lambda wc: with_speedup_settings(acceptance_settings(wc.variant),
                                                  stages.variant_config(config, wc.variant)["verify"]),
        suites=lambda wc: suite_flags(),
        code=code_version("measure_acceptance.py", "run_on_gpus.py"),
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
        "python {params.gpu_wrapper} --gpus {resources.gpu} --pipeline-parallel {params.pipeline_parallel} --"
        " python {params.script} --settings {params.settings:q}"
        " --target {input.target} --draft {input.draft} --untrained {input.untrained}"
        " --prompts {input.prompts} {params.suites} --baseline {input.baseline} --out {output} > {log} 2>&1"


rule report:
    input:
        contract=f"{R}/drafts/{{variant}}/verify/contract.json",
        acceptance=f"{R}/drafts/{{variant}}/verify/acceptance.json",
        overlaps=lambda wc: suite_overlap_files(),
        metrics=f"{R}/drafts/{{variant}}/train_metrics.csv",
        provenance=lambda wc: provenance_chain(wc.variant),
        # The run's speedup forecast, where it has one: the report places this draft on it.
        forecast=lambda wc: [f"{R}/forecast/forecast.json"] if config["forecast"]["enabled"] else [],
        # The serving schedule's speculative config names the draft and reads its type.
        draft=f"{R}/drafts/{{variant}}/final",
    output:
        verification=report(f"{R}/drafts/{{variant}}/report/verification.json", category="Verification", labels={"variant": "{variant}", "file": "verification.json"}),
        markdown=report(f"{R}/drafts/{{variant}}/report/report.md", category="Verification", labels={"variant": "{variant}", "file": "report.md"}),
        html=report(f"{R}/drafts/{{variant}}/report/report.html", category="Verification", labels={"variant": "{variant}", "file": "report.html"}),
        # The k per batch size for `vllm serve --speculative-config` (or why there is none).
        schedule=f"{R}/drafts/{{variant}}/report/serving_schedule.json",
    params:
        script=script("make_report.py"),
        settings=lambda wc: settings("verify"),
        # The stage instances the draft descends from, and how the variant differs from the base.
        lineage=lambda wc: variant_lineage(wc.variant),
        forecast=lambda wc, input: f"--forecast {input.forecast}" if input.forecast else "",
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
        "python {params.script} --settings {params.settings:q} --variant {wildcards.variant}"
        " --lineage {params.lineage:q}"
        " --contract {input.contract} --acceptance {input.acceptance} --metrics {input.metrics}"
        " --provenance {input.provenance} --overlaps {input.overlaps} {params.forecast}"
        " --draft {input.draft} --schedule {output.schedule}"
        " --out-dir $(dirname {output.verification})"
        " > {log} 2>&1"


rule compare_variants:
    input:
        reports=expand(f"{R}/drafts/{{variant}}/report/verification.json", variant=VARIANTS),
    output:
        csv=report(f"{R}/drafts/comparison.csv", category="Verification", labels={"file": "comparison.csv"}),
        markdown=f"{R}/drafts/comparison.md",
        html=report(f"{R}/drafts/comparison.html", category="Verification", labels={"file": "comparison.html"}),
    params:
        script=script("compare_variants.py"),
        code=code_version("compare_variants.py"),
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/compare_variants.log",
    benchmark:
        f"{R}/benchmarks/compare_variants.tsv"
    threads: 1
    shell:
        "python {params.script} --reports {input.reports} --out {output.csv}"
        " --markdown {output.markdown} --html {output.html} > {log} 2>&1"
