from django.db import migrations, models


def forget_rollups(apps, schema_editor):
    """The rollups are summed again from the raw records, now per K too (the next refresh does it)."""
    apps.get_model("speculation", "StageRollup").objects.all().delete()
    apps.get_model("speculation", "RollupState").objects.filter(name="stage_records").update(rolled_until=None)


class Migration(migrations.Migration):
    dependencies = [
        ("speculation", "0017_draft_and_run_ownership"),
    ]

    operations = [
        migrations.RemoveConstraint(model_name="stagerollup", name="stage_rollup_workload_key"),
        migrations.AddField(model_name="stagerollup", name="k", field=models.PositiveSmallIntegerField(default=0)),
        migrations.AddField(model_name="stagerollup", name="seconds", field=models.PositiveIntegerField(default=60)),
        migrations.AddConstraint(
            model_name="stagerollup",
            constraint=models.UniqueConstraint(
                fields=("endpoint", "bucket_start", "mode", "action", "workload", "k"), name="stage_rollup_key"
            ),
        ),
        migrations.RunPython(forget_rollups, migrations.RunPython.noop),
    ]
