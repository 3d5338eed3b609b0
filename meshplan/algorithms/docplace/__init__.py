"""``doc-place``: packed documents placed by their work — short ones whole on one rank, long ones split across a
subgroup sized to them (issue 25; :mod:`.placement`)."""
