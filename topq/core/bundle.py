"""The bundle as the core reads it: the container (`topq.io.bundle`) and the model its document describes."""

from __future__ import annotations

from topq.core.errors import TopqError
from topq.core.spec import ModelSpec
from topq.io.bundle import BundleFile


class Bundle(BundleFile):
    """A loaded bundle (see `BundleFile`) with its model spec, checked when the bundle is opened."""

    spec: ModelSpec

    def check_document(self) -> None:
        super().check_document()
        try:
            self.spec = ModelSpec.from_dict(self.meta["spec"])
        except TopqError as exc:
            raise TopqError(f"{self.path}: damaged bundle ({exc})") from None
