"""The password and the ACL of docs/security.md's locked-down mosquitto, for the attack tests: every user's
password, and what each may publish and read."""

PASSWORD = "pw"
ACL = """user aggregator
topic readwrite nefl/t/#
pattern write nefl/t/announce/%u
pattern write nefl/t/decline/%u
pattern write nefl/t/status/%u
pattern write nefl/t/update/%u
pattern write nefl/t/sent/%u
pattern write nefl/t/resend/%u
pattern read  nefl/t/task/%u
pattern read  nefl/t/refusal/%u
pattern read  nefl/t/model/#
pattern read  nefl/t/control
pattern read  nefl/t/server/status
"""
