"""What ``streaming.vision`` imports at module level; never used by the tests."""


def to_tensor(pic: object) -> None:
    raise RuntimeError("a placeholder torchvision (tests/placeholders) cannot convert images")
