"""``nondet fixes``: the fixes nondet can apply from outside a script (``--apply FIX_ID``)."""

from __future__ import annotations

import click

from nondet.cli._common import App


@click.command()
@click.pass_obj
def fixes(app: App) -> int:
    """List the fixes nondet can apply from outside a script: id, how, what it does.

    Use one with `nondet run --apply FIX_ID SCRIPT` (or `nondet check --apply ...`);
    `nondet run` also tries them itself to verify the fix it suggests.
    """
    from nondet import interventions

    width = max(len(i) for i in interventions.TABLE)
    for item in interventions.TABLE.values():
        app.out.print(f"{item.id:<{width}}  {item.how:<6}  {item.does}", highlight=False,
                      markup=False)
    return 0
