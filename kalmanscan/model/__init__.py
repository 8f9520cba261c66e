"""The mathematics every caller shares: the exact OU discretisation (:mod:`.ou`), the Möbius and
affine algebra of the information-form filter (:mod:`.mobius`), the merged single-scan form that
splits time across programs and processes (:mod:`.merged`) and a time-parallel associative scan in
torch ops (:mod:`.scan`). Nothing here knows about user input, backends or results."""
