"""What ``streaming.vision`` imports at module level; never used by the tests."""


class VisionDataset:
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("a placeholder torchvision (tests/placeholders) cannot build datasets")
