# Stage 1 - target: materialize the target model (local dir, pinned hub revision or GGUF)
# as a plain HF safetensors dir, and record its config/weights/tokenizer/template digests.


rule target:
    input:
        target_source_inputs,
    output:
        model=directory(f"{R}/target/model"),
        manifest=f"{R}/target/manifest.json",
        provenance=f"{R}/target/provenance.json",
    params:
        script=script("materialize_target.py"),
        settings=lambda wc: settings("target"),
        packaged_sources=lambda wc: packaged_digests(target_source_refs()),
        code=code_version("materialize_target.py"),
    conda:
        CONDA_ENV
    log:
        f"{R}/logs/target.log",
    benchmark:
        f"{R}/benchmarks/target.tsv"
    threads: res("default", "threads")
    resources:
        mem_mb=res("default", "mem_mb"),
        runtime=res("default", "runtime"),
    shell:
        "python {params.script} --settings {params.settings:q}"
        " --out-dir {output.model} --manifest {output.manifest}"
        " --provenance {output.provenance} > {log} 2>&1"
