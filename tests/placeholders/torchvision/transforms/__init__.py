"""A placeholder torchvision for tests that import mosaicml-streaming (see ../../README.md)."""
