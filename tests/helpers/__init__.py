"""Test support shared by the test modules (no tests here; a test module never imports another test module,
tests/test_test_layout.py checks). tests/conftest.py puts tests/ on sys.path: ``from helpers.models import ...``.

    paths        REPO, DATA, FIXTURE (the bundled trained model)
    models       tiny random models of every family (a saved HF checkpoint, or a module)
    checkpoints  edgeq checkpoints made by the real pipeline, the dequantised reference, a synthetic one, dir_digest
    cli          run_cli: the real ``edgeq`` entry point in this process -> (exit code, stdout, stderr)
    gptq         a test-side GPTQ writer (GPTQModel's packing, v1 and v2 zero conventions)
    native       the W4A16 kernel's test problems (min/max-quantised weights, the fp64 reference and its bound)
    perm         rewriting a checkpoint's q/k/v with a stored input permutation
    serve        running_server: an app on a real uvicorn on a free loopback port
"""
