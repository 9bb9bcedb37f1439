"""The vocabulary: .proto sources and the Python modules generated from them by protos/build.py."""
