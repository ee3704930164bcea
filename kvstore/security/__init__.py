"""Who may call what: access files, principals, the gRPC gate and TLS settings.

Spec of the access file and of what each role may do: docs/security.md.
"""
