"""Apply an RBAC plan (cgn_core.rbac) to etcd: roles, their grants, users, then auth on.

Idempotent: a role or user that exists is kept (its grants are re-granted, which etcd
accepts), so the same command can add a node later. Users have no password: with etcd's
`--client-cert-auth`, a certificate's CN names the user.
"""

from __future__ import annotations

import grpc

from cgn_core.etcd.client import EtcdClient, EtcdError
from cgn_core.rbac import Plan
from cgn_proto.etcd import auth_pb2, rpc_pb2, rpc_pb2_grpc

_PERMS = {
    "read": auth_pb2.Permission.READ,
    "write": auth_pb2.Permission.WRITE,
    "readwrite": auth_pb2.Permission.READWRITE,
}


async def apply_plan(client: EtcdClient, plan: Plan, *, enable: bool = True) -> None:
    """Create `plan`'s roles and users in etcd, then (with `enable`) switch auth on."""
    for role, grants in plan.roles.items():
        await _rpc(client, "RoleAdd", rpc_pb2.AuthRoleAddRequest(name=role), exists_ok=True)
        for g in grants:
            perm = auth_pb2.Permission(
                permType=_PERMS[g.perm],
                key=g.key.encode("latin-1"),
                range_end=g.range_end.encode("latin-1"),
            )
            req = rpc_pb2.AuthRoleGrantPermissionRequest(name=role, perm=perm)
            await _rpc(client, "RoleGrantPermission", req)
    for user, roles in plan.users.items():
        options = auth_pb2.UserAddOptions(no_password=True)
        req_user = rpc_pb2.AuthUserAddRequest(name=user, options=options)
        await _rpc(client, "UserAdd", req_user, exists_ok=True)
        for role in roles:
            await _rpc(
                client, "UserGrantRole", rpc_pb2.AuthUserGrantRoleRequest(user=user, role=role)
            )
    if enable:
        await _rpc(client, "AuthEnable", rpc_pb2.AuthEnableRequest())


async def _rpc(client: EtcdClient, method: str, request: object, exists_ok: bool = False) -> None:
    """One Auth RPC; with `exists_ok`, etcd's "already exists" is success (idempotence)."""

    async def call(ch: grpc.aio.Channel) -> object:
        return await getattr(rpc_pb2_grpc.AuthStub(ch), method)(request)

    try:
        await client.call(call)
    except EtcdError as exc:
        if not (exists_ok and "already exists" in exc.message):
            raise


async def delete_user(client: EtcdClient, user: str) -> bool:
    """Delete etcd user `user`; False when there is none (RBAC never applied for it)."""
    try:
        await _rpc(client, "UserDelete", rpc_pb2.AuthUserDeleteRequest(name=user))
    except EtcdError as exc:
        if "not found" in exc.message:
            return False
        raise
    return True
