"""The cost policy's TPOT slack ledger (hetmesh.placement.slack), by hand."""

import pytest

from hetmesh.placement.slack import SlackLedger


def test_a_prefill_takes_slack_from_the_decodes_it_overlaps() -> None:
    led = SlackLedger()
    led.add(0, start=1.0, end=2.0, slack=0.3, tokens=20)  # decoding on slot 0 from 1 s to 2 s, 0.3 s to spare
    led.add(0, start=5.0, end=6.0, slack=0.05, tokens=7)  # later, 0.05 s to spare
    led.add(1, start=1.0, end=2.0, slack=0.01, tokens=99)  # another worker
    # a prefill on slot 0 running 1.5-1.7 s, taking 0.2 s from the decodes beside it: the first keeps 0.1 s
    assert led.harm(0, start=1.5, pf=0.2, stolen=0.2, now=0.0) == 0.0
    assert led.harm(0, start=1.5, pf=0.2, stolen=0.4, now=0.0) == 20.0  # 0.4 > 0.3: pushed past its SLO
    assert led.harm(0, start=4.0, pf=1.5, stolen=0.1, now=0.0) == 7.0  # overlaps only the second
    led.stall(0, start=1.5, pf=0.2, stolen=0.25, now=0.0)
    assert led.harm(0, start=1.9, pf=0.1, stolen=0.06, now=0.0) == 20.0  # 0.05 left, and it ends 0.25 s later
    assert led.harm(0, start=2.2, pf=0.1, stolen=0.06, now=0.0) == 20.0
    led.stall(0, start=1.9, pf=0.1, stolen=0.06, now=0.0)  # now past its SLO: lost already, no more harm
    assert led.harm(0, start=1.9, pf=0.1, stolen=1.0, now=0.0) == 0.0
    assert led.harm(0, start=5.5, pf=0.1, stolen=0.06, now=3.0) == 7.0  # the first has ended by 3 s: gone
    assert led.harm(1, start=0.0, pf=5.0, stolen=0.02, now=0.0) == 99.0
    assert led.harm(2, start=0.0, pf=5.0, stolen=1.0, now=0.0) == 0.0  # nothing placed there
    with pytest.raises(KeyError):
        led._rows[2]
