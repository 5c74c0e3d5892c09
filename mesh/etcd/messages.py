"""etcd's v3 gRPC messages, written and read here in protobuf's wire format: the ones tiermesh sends and reads.

Why not protobuf's generated classes: the protobuf runtime and the classes of etcd's three proto files held
about 3 MiB of an idle edge agent (issue 17), for some twenty small messages. These are those messages, each a
class with the fields of etcd 3.5's ``rpc.proto``, ``kv.proto`` and ``auth.proto`` (same names, numbers and
types), built by keyword (``RangeRequest(key=b"k", range_end=b"l")``), read by attribute, written and read by
:mod:`mesh.protowire` (proto3 semantics: a oneof member such as ``Compare.mod_revision`` is sent when set,
zero included). Enum values are class attributes, as in the generated code: ``Compare.EQUAL``,
``RangeRequest.ASCEND``, ``Event.DELETE``. ``SERVICES`` names each service's methods and their types.
``tests/unit/test_etcd_messages.py`` checks every field here against the descriptors protobuf generates from
etcd's protos, and round-trips through both.
"""

from __future__ import annotations

from mesh.protowire import Message, fields

__all__ = ["PACKAGE", "SERVICES"]

# ---------------------------------------------------------------- kv.proto (mvccpb)


class KeyValue(Message):
    FIELDS = fields((1, "key", "bytes"), (2, "create_revision", "int64"), (3, "mod_revision", "int64"),
                    (4, "version", "int64"), (5, "value", "bytes"), (6, "lease", "int64"))


class Event(Message):
    PUT, DELETE = 0, 1
    FIELDS = fields((1, "type", "enum"), (2, "kv", "message", False, "KeyValue"),
                    (3, "prev_kv", "message", False, "KeyValue"))


# ---------------------------------------------------------------- auth.proto (authpb)


class Permission(Message):
    READ, WRITE, READWRITE = 0, 1, 2
    FIELDS = fields((1, "permType", "enum"), (2, "key", "bytes"), (3, "range_end", "bytes"))


# ---------------------------------------------------------------- rpc.proto (etcdserverpb)


class ResponseHeader(Message):
    FIELDS = fields((1, "cluster_id", "uint64"), (2, "member_id", "uint64"), (3, "revision", "int64"),
                    (4, "raft_term", "uint64"))


_HEADER = (1, "header", "message", False, "ResponseHeader")


class RangeRequest(Message):
    NONE, ASCEND, DESCEND = 0, 1, 2                      # SortOrder
    KEY, VERSION, CREATE, MOD, VALUE = 0, 1, 2, 3, 4     # SortTarget
    FIELDS = fields((1, "key", "bytes"), (2, "range_end", "bytes"), (3, "limit", "int64"), (4, "revision", "int64"),
                    (5, "sort_order", "enum"), (6, "sort_target", "enum"), (7, "serializable", "bool"),
                    (8, "keys_only", "bool"), (9, "count_only", "bool"), (10, "min_mod_revision", "int64"),
                    (11, "max_mod_revision", "int64"), (12, "min_create_revision", "int64"),
                    (13, "max_create_revision", "int64"))


class RangeResponse(Message):
    FIELDS = fields(_HEADER, (2, "kvs", "message", True, "KeyValue"), (3, "more", "bool"), (4, "count", "int64"))


class PutRequest(Message):
    FIELDS = fields((1, "key", "bytes"), (2, "value", "bytes"), (3, "lease", "int64"), (4, "prev_kv", "bool"),
                    (5, "ignore_value", "bool"), (6, "ignore_lease", "bool"))


class PutResponse(Message):
    FIELDS = fields(_HEADER, (2, "prev_kv", "message", False, "KeyValue"))


class DeleteRangeRequest(Message):
    FIELDS = fields((1, "key", "bytes"), (2, "range_end", "bytes"), (3, "prev_kv", "bool"))


class DeleteRangeResponse(Message):
    FIELDS = fields(_HEADER, (2, "deleted", "int64"), (3, "prev_kvs", "message", True, "KeyValue"))


class RequestOp(Message):
    FIELDS = fields((1, "request_range", "message", False, "RangeRequest", "request"),
                    (2, "request_put", "message", False, "PutRequest", "request"),
                    (3, "request_delete_range", "message", False, "DeleteRangeRequest", "request"),
                    (4, "request_txn", "message", False, "TxnRequest", "request"))


class ResponseOp(Message):
    FIELDS = fields((1, "response_range", "message", False, "RangeResponse", "response"),
                    (2, "response_put", "message", False, "PutResponse", "response"),
                    (3, "response_delete_range", "message", False, "DeleteRangeResponse", "response"),
                    (4, "response_txn", "message", False, "TxnResponse", "response"))


class Compare(Message):
    EQUAL, GREATER, LESS, NOT_EQUAL = 0, 1, 2, 3          # CompareResult
    VERSION, CREATE, MOD, VALUE, LEASE = 0, 1, 2, 3, 4     # CompareTarget
    FIELDS = fields((1, "result", "enum"), (2, "target", "enum"), (3, "key", "bytes"),
                    (4, "version", "int64", False, "", "target_union"),
                    (5, "create_revision", "int64", False, "", "target_union"),
                    (6, "mod_revision", "int64", False, "", "target_union"),
                    (7, "value", "bytes", False, "", "target_union"),
                    (8, "lease", "int64", False, "", "target_union"), (64, "range_end", "bytes"))


class TxnRequest(Message):
    FIELDS = fields((1, "compare", "message", True, "Compare"), (2, "success", "message", True, "RequestOp"),
                    (3, "failure", "message", True, "RequestOp"))


class TxnResponse(Message):
    FIELDS = fields(_HEADER, (2, "succeeded", "bool"), (3, "responses", "message", True, "ResponseOp"))


class CompactionRequest(Message):
    FIELDS = fields((1, "revision", "int64"), (2, "physical", "bool"))


class CompactionResponse(Message):
    FIELDS = fields(_HEADER)


class WatchCreateRequest(Message):
    NOPUT, NODELETE = 0, 1  # FilterType
    FIELDS = fields((1, "key", "bytes"), (2, "range_end", "bytes"), (3, "start_revision", "int64"),
                    (4, "progress_notify", "bool"), (5, "filters", "enum", True), (6, "prev_kv", "bool"),
                    (7, "watch_id", "int64"), (8, "fragment", "bool"))


class WatchCancelRequest(Message):
    FIELDS = fields((1, "watch_id", "int64"))


class WatchProgressRequest(Message):
    """No fields."""


class WatchRequest(Message):
    FIELDS = fields((1, "create_request", "message", False, "WatchCreateRequest", "request_union"),
                    (2, "cancel_request", "message", False, "WatchCancelRequest", "request_union"),
                    (3, "progress_request", "message", False, "WatchProgressRequest", "request_union"))


class WatchResponse(Message):
    FIELDS = fields(_HEADER, (2, "watch_id", "int64"), (3, "created", "bool"), (4, "canceled", "bool"),
                    (5, "compact_revision", "int64"), (6, "cancel_reason", "string"), (7, "fragment", "bool"),
                    (11, "events", "message", True, "Event"))


class LeaseGrantRequest(Message):
    FIELDS = fields((1, "TTL", "int64"), (2, "ID", "int64"))


class LeaseGrantResponse(Message):
    FIELDS = fields(_HEADER, (2, "ID", "int64"), (3, "TTL", "int64"), (4, "error", "string"))


class LeaseRevokeRequest(Message):
    FIELDS = fields((1, "ID", "int64"))


class LeaseRevokeResponse(Message):
    FIELDS = fields(_HEADER)


class LeaseKeepAliveRequest(Message):
    FIELDS = fields((1, "ID", "int64"))


class LeaseKeepAliveResponse(Message):
    FIELDS = fields(_HEADER, (2, "ID", "int64"), (3, "TTL", "int64"))


class AuthEnableRequest(Message):
    """No fields."""


class AuthEnableResponse(Message):
    FIELDS = fields(_HEADER)


class UserAddOptions(Message):
    FIELDS = fields((1, "no_password", "bool"))


class AuthUserAddRequest(Message):
    FIELDS = fields((1, "name", "string"), (2, "password", "string"),
                    (3, "options", "message", False, "UserAddOptions"), (4, "hashedPassword", "string"))


class AuthUserAddResponse(Message):
    FIELDS = fields(_HEADER)


class AuthRoleAddRequest(Message):
    FIELDS = fields((1, "name", "string"))


class AuthRoleAddResponse(Message):
    FIELDS = fields(_HEADER)


class AuthRoleGrantPermissionRequest(Message):
    FIELDS = fields((1, "name", "string"), (2, "perm", "message", False, "Permission"))


class AuthRoleGrantPermissionResponse(Message):
    FIELDS = fields(_HEADER)


class AuthUserGrantRoleRequest(Message):
    FIELDS = fields((1, "user", "string"), (2, "role", "string"))


class AuthUserGrantRoleResponse(Message):
    FIELDS = fields(_HEADER)


class AuthUserRevokeRoleRequest(Message):
    FIELDS = fields((1, "name", "string"), (2, "role", "string"))


class AuthUserRevokeRoleResponse(Message):
    FIELDS = fields(_HEADER)


class AuthUserGetRequest(Message):
    FIELDS = fields((1, "name", "string"))


class AuthUserGetResponse(Message):
    FIELDS = fields(_HEADER, (2, "roles", "string", True))


class AuthUserDeleteRequest(Message):
    FIELDS = fields((1, "name", "string"))


class AuthUserDeleteResponse(Message):
    FIELDS = fields(_HEADER)


# service -> method -> (request, reply, streaming); paths are /etcdserverpb.<service>/<method>
SERVICES: dict[str, dict[str, tuple[str, str, bool]]] = {
    "KV": {"Range": ("RangeRequest", "RangeResponse", False), "Put": ("PutRequest", "PutResponse", False),
           "DeleteRange": ("DeleteRangeRequest", "DeleteRangeResponse", False),
           "Txn": ("TxnRequest", "TxnResponse", False), "Compact": ("CompactionRequest", "CompactionResponse", False)},
    "Watch": {"Watch": ("WatchRequest", "WatchResponse", True)},
    "Lease": {"LeaseGrant": ("LeaseGrantRequest", "LeaseGrantResponse", False),
              "LeaseRevoke": ("LeaseRevokeRequest", "LeaseRevokeResponse", False),
              "LeaseKeepAlive": ("LeaseKeepAliveRequest", "LeaseKeepAliveResponse", True)},
    "Auth": {"AuthEnable": ("AuthEnableRequest", "AuthEnableResponse", False),
             "UserAdd": ("AuthUserAddRequest", "AuthUserAddResponse", False),
             "RoleAdd": ("AuthRoleAddRequest", "AuthRoleAddResponse", False),
             "RoleGrantPermission": ("AuthRoleGrantPermissionRequest", "AuthRoleGrantPermissionResponse", False),
             "UserGrantRole": ("AuthUserGrantRoleRequest", "AuthUserGrantRoleResponse", False),
             "UserGet": ("AuthUserGetRequest", "AuthUserGetResponse", False),
             "UserRevokeRole": ("AuthUserRevokeRoleRequest", "AuthUserRevokeRoleResponse", False),
             "UserDelete": ("AuthUserDeleteRequest", "AuthUserDeleteResponse", False)},
}
PACKAGE = "etcdserverpb"
