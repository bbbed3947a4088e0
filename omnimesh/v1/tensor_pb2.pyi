from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShmRef(_message.Message):
    __slots__ = ("host_id", "region", "slot", "generation", "offset", "nbytes")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    region: str
    slot: int
    generation: int
    offset: int
    nbytes: int
    def __init__(self, host_id: _Optional[str] = ..., region: _Optional[str] = ..., slot: _Optional[int] = ..., generation: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class CudaIpcRef(_message.Message):
    __slots__ = ("host_id", "region", "slot", "generation", "device", "handle", "nbytes")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    region: str
    slot: int
    generation: int
    device: int
    handle: bytes
    nbytes: int
    def __init__(self, host_id: _Optional[str] = ..., region: _Optional[str] = ..., slot: _Optional[int] = ..., generation: _Optional[int] = ..., device: _Optional[int] = ..., handle: _Optional[bytes] = ..., nbytes: _Optional[int] = ...) -> None: ...

class TensorFrame(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data", "shm", "cuda_ipc", "piece_offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    PIECE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    shm: ShmRef
    cuda_ipc: CudaIpcRef
    piece_offset: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., shm: _Optional[_Union[ShmRef, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcRef, _Mapping]] = ..., piece_offset: _Optional[int] = ...) -> None: ...
