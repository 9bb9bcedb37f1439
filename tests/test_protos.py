from peerd.protos import build


def test_generated_code_is_current():
    # Regenerates every *_pb2*.py from protos/*.proto in a temp dir and compares byte for byte.
    assert build.main(["--check"]) == 0, "run `python -m peerd.protos.build` and commit the result"
