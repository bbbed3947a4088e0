"""Generated protobuf / gRPC code for package `omnimesh.v1` (see `omnimesh/protogen.py`). Do not edit."""
