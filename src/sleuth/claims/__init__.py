"""Each paper's own claim, reproduced end to end: `sleuth reproduce <claim>`.

One module per claim (staged, r_search, qagent, s3) declares its arms, stages, premise check, decisive tests and
table (`sleuth.claims.base.ClaimSpec`); the runner, `--arms`, resume, the bundle and the report all read that
declaration. Importing the package registers the built-in claims, in the order `sleuth reproduce --help` lists them.
"""

from sleuth.claims import staged, r_search, qagent, s3  # noqa: I001, F401  (each registers its claim)
